"""The study of how training scales: grids of configurations, throughput benches, learning
studies, their tables, flags, plots and report. It imports the core and the performance model;
neither imports it."""
