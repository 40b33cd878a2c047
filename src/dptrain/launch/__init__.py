"""The launcher side: the checks made before any worker starts (checks.py), the torchrun command line and its
exit codes (torchrun.py), waiting at the rendezvous (rendezvous_wait.py), the per-rank entry point torchrun
starts (worker.py), elastic node counts (elastic.py), a cluster's launch environment (cluster_env.py),
`dptrain launch` of a user's script (record_script.py), `notebook_launch` (notebook.py) and warm spare workers
(warm.py, warm_server.py, warm_client.py)."""
