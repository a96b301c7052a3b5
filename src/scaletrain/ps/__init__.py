"""Parameter servers: the server loop, how parameters are sharded, versions and staleness."""
