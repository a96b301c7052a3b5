"""Communication between the processes of a job, over torch.distributed.

The package is named comm, not dist, so that it never shadows torch.distributed, which every
module here imports as `dist`. Nothing happens at import time; each module says what it does:

- groups.py: joining the job (the rendezvous), the process groups, and the Context every
  process carries (its place in the plan, its groups, what the heartbeats found).
- p2p.py: point-to-point messages (the parameter servers' traffic), waited for as long as the
  peer needs.
- liveness.py: the heartbeats that find a dead or frozen process, and the requests (checkpoint,
  stop) they spread to every process.
- end.py: how a process leaves the job: stopped by a signal, done (the final meeting), or failed.
"""
