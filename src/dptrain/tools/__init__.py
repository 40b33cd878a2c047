"""Tools beside training: the planner (plan/), the benchmark harness (bench/), run reports (report/),
cluster manifests (deploy/), the environment doctor (doctor.py) and the two-host test cluster
(netns.py). They may import the core; nothing in the core imports them (see docs/architecture.md)."""
