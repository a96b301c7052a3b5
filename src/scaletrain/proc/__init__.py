"""Process primitives, below the orchestrators (launch/) and beside comm/: the job's environment and
rendezvous (env), the network interfaces (fabric), stop signals held while a process starts (early),
a child's death with its parent (parent) and the CPUs a node's processes need (cpus). Everything in
the core may import these; only the entry points import launch/."""
