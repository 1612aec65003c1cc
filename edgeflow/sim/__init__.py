"""A whole fleet in one process: simulation, the demo, the run report."""
