"""Starting the processes of a plan: locally, under torchrun, under Slurm."""
