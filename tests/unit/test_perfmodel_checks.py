"""The performance model's checks on itself: a calibration that cannot be true is flagged and
recommend refuses it, a prediction whose speedup falls with nodes is marked, durations read in
human units, and the long commands say how far they have come. Hand-made figures and profiles,
no real calibration (tests/e2e/test_calibrate.py has the one on a loaded host)."""

from dataclasses import replace

from conftest import ROOT

from scaletrain.cli import main
from scaletrain.perfmodel.predict import human_time, signed_time
from scaletrain.perfmodel.profile import Profile, dump_profile
from scaletrain.perfmodel.trust import LOAD_BOUND, SPREAD_BOUND, Machine, busy_flags, load_flags, spread_flags
from scaletrain.perfmodel.recommend import falling_speedups, progress_note
from scaletrain.perfmodel.rounds import rounds

# resnet8 at 16 px, as recipes/digits.toml trains it; compute 1 s a step, everything else cheap.
TOY = Profile(model="resnet8", image_size=16, batch_per_replica=32, gradient_bytes=1_000_000, replicas_per_node=1,
              compute_s=1.0, optimizer_s=0.01, intra_bandwidth=1e9, intra_latency=1e-4, net_bandwidth=1e9,
              net_latency=1e-4, local_bandwidth=1e9, ps_apply_rate=1e9)
FLAG = "the 2-replica job's all-reduce 1330.3 x as slow as in the microbenchmark (allreduce_load; bound 10 x)"


# --- calibrate's flags ------------------------------------------------------------------------

def test_spread_flags_fire_beyond_their_bound_only():
    flags = spread_flags({"job2.step_s": SPREAD_BOUND * 1.5, "p2p.p2p_1": SPREAD_BOUND * 0.9, "cpu.copy_s": 0.0})
    assert flags == [f"job2.step_s varied by {SPREAD_BOUND * 1.5:.2f} of its median between rounds "
                     f"(bound {SPREAD_BOUND:g})"]


def test_load_flags_fire_on_a_job_orders_of_magnitude_off():
    assert load_flags({"allreduce_load": 1330.34, "transfer_load": 2.0}) == [FLAG]
    assert load_flags({"allreduce_load": LOAD_BOUND * 0.99, "transfer_load": 0.2}) == []
    assert load_flags({}) == []  # a GPU calibration runs neither job
    assert "the PS job's transfers 31.0 x" in load_flags({"transfer_load": 31.0})[0]


def machines(load_before=0.2, load_after=1.9, own_cores=1.9, others_cores=0.0, seconds=60.0):
    """Snapshots of a 2-core host `seconds` apart, the calibration using `own_cores` of them on
    average and other processes `others_cores`."""
    before = Machine(at=100.0, load=load_before, busy_s=1000.0, total_s=5000.0, own_s=3.0)
    after = Machine(at=100.0 + seconds, load=load_after, busy_s=1000.0 + (own_cores + others_cores) * seconds,
                    total_s=5000.0 + 2 * seconds, own_s=3.0 + own_cores * seconds)
    return before, after


def test_busy_flags_on_a_quiet_and_on_a_busy_host():
    # Quiet: the load average after is the calibration's own jobs; others used 10% of a core.
    assert busy_flags(*machines(others_cores=0.1), cores=2) == []
    # Others used a core of two while it ran: half the cores' time.
    assert busy_flags(*machines(own_cores=1.0, others_cores=1.0), cores=2) == [
        "other processes took 50% of the cores' time while calibrating (bound 25%)"]
    # Runnable processes before it started, and after it, beyond its own 1.9 cores.
    before, after = machines(load_before=1.5, load_after=3.2)
    assert busy_flags(before, after, cores=2) == [
        "load average 1.50 before calibrating, on 2 cores (bound 1.0)",
        "load average 3.20 after calibrating, 1.30 beyond its own 1.90 cores, on 2 cores (bound 1.0)"]
    # Within the bounds: a load of one core before, others at a fifth of the cores' time.
    assert busy_flags(*machines(load_before=1.0, load_after=2.9, others_cores=0.4), cores=2) == []
    # No /proc/stat: the load averages alone.
    before, after = machines()
    assert busy_flags(replace(before, busy_s=0.0, total_s=0.0), replace(after, busy_s=0.0, total_s=0.0), 2) == []


# --- recommend refuses a flagged profile ------------------------------------------------------

def write(tmp_path, prof: Profile, about: dict, name="p.toml"):
    path = tmp_path / name
    path.write_text(dump_profile(prof, about))
    return str(path)


RECOMMEND = ["--recipe", "recipes/digits.toml", "--recommend", "--max-nodes", "2"]


def test_recommend_refuses_a_flagged_profile_and_goes_on_with_force(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    flagged = write(tmp_path, TOY, {"flags": [FLAG, "job2.step_s varied by 3.10 of its median between rounds"]})
    assert main(["predict", "--profile", flagged, *RECOMMEND]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"scaletrain: error: profile {flagged} is flagged: {FLAG} (and 1 more); calibrate "
                                 "again on a quiet machine, or give --force to recommend from it anyway\n")
    assert main(["predict", "--profile", flagged, *RECOMMEND, "--force"]) == 0
    out, err = capsys.readouterr()
    assert f"scaletrain: warning: profile {flagged} is flagged: {FLAG}\n" in err and "| 2 |" in out
    # Plain predict warns and goes on.
    assert main(["predict", "--profile", flagged, "--recipe", "recipes/digits.toml"]) == 0
    out, err = capsys.readouterr()
    assert err.count("scaletrain: warning:") == 2 and "| resnet8" not in err and "| Setup |" in out
    # A profile without flags, as every profile before them: no word of them.
    plain = write(tmp_path, TOY, {}, "plain.toml")
    assert main(["predict", "--profile", plain, *RECOMMEND]) == 0
    assert "flag" not in capsys.readouterr().err


# --- a prediction outside the physics ---------------------------------------------------------

def fastest(*speedups, strategy="allreduce"):
    return {n: {strategy: {"strategy": strategy, "speedup": s, "bottleneck": "compute"}}
            for n, s in zip((1, 2, 4, 8), speedups)}


def test_a_speedup_falling_with_nodes_is_flagged():
    assert falling_speedups(fastest(1.0, 1.8, 1.5)) == {
        ("allreduce", 4): "allreduce's speedup falls as nodes grow: 1.80 at 2 nodes, 1.50 at 4 (compute bound)"}
    assert falling_speedups(fastest(1.0, 1.8, 1.75, 3.0)) == {}  # within 5% of its peak: levelling off


def test_recommend_marks_an_allreduce_that_gets_slower_with_nodes(tmp_path, capsys, monkeypatch):
    """A ring whose 1 s latency outweighs the compute it spreads (2(n-1) latencies a step), and
    parameter servers slower still: all-reduce wins at every node count, at a falling speedup."""
    monkeypatch.chdir(ROOT)
    slow = replace(TOY, net_latency=1.0, intra_latency=1.0, ps_apply_rate=1e3, ps_accumulate_rate=1e3)
    path = write(tmp_path, slow, {})
    assert main(["predict", "--profile", path, "--recipe", "recipes/digits.toml", "--recommend",
                 "--max-nodes", "2"]) == 0
    out, err = capsys.readouterr()
    two = next(line for line in out.splitlines() if line.startswith("| 2 |"))
    assert "allreduce, 2 nodes" in two and "[flagged: speedup falls as nodes grow]" in two, out
    assert "[flagged" not in next(line for line in out.splitlines() if line.startswith("| 1 |"))
    said = [line for line in err.splitlines() if "flagged rows" in line]
    assert len(said) == 1 and "allreduce's speedup falls as nodes grow: 1.00 at 1 node, 0.67 at 2" in said[0], err


# --- human units and progress -----------------------------------------------------------------

def test_human_time():
    assert [human_time(s) for s in (0.5, 90, 2 * 3600, 3 * 86400)] == ["500 ms", "1.5 min", "2.0 h", "3.0 d"]
    assert [human_time(s) for s in (0.00275, 9.9, 14 * 60, 0)] == ["2.8 ms", "9.9 s", "14 min", "0 s"]
    assert (signed_time(0.0), signed_time(-9.9), signed_time(3.2 * 3600)) == ("+0 s", "-9.9 s", "+3.2 h")


def test_predict_tables_speak_in_human_units(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["predict", "--profile", "profiles/study-k80.toml", "--recipe", "recipes/anp-resnet50.toml",
                 "--set", "cluster.gpus_per_node=4", "--set", "cluster.nodes=1"]) == 0
    head, _, row = capsys.readouterr().out.splitlines()
    assert "| Step | " in head and "| Epoch | Training time |" in head
    assert row.endswith("| 2.7 h | 4.4 d |"), row  # 1.2 million images at 124 img/s; 39.5 epochs


def test_progress_says_what_is_done_and_what_is_left():
    # Node counts weigh candidates x nodes: 2 x 1 done in 10 s, 3 x 2 to go.
    assert progress_note({1: [0, 0], 2: [0, 0, 0]}, [1], 10.0) == "1 of 2 node counts done, 10 s in, about 30 s left"
    assert progress_note({1: [0, 0], 2: [0, 0, 0]}, [1, 2], 40.0) == "2 of 2 node counts done, 40 s in"
    now, told = [0.0], []

    def measure():
        now[0] += 20.0
        return {"x": 1.0}
    rounds({"a": measure}, 3, say=lambda *_: None, clock=lambda: now[0], tell=told.append)
    assert told == ["calibrate: round 1 of 3 done, 20 s in, about 40 s left",
                    "calibrate: round 2 of 3 done, 40 s in, about 20 s left", "calibrate: round 3 of 3 done, 60 s in"]
