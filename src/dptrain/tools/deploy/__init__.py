"""Running dptrain where training runs: the Kubeflow PyTorchJob and Slurm sbatch writers
(`dptrain manifest kubeflow|slurm`) and the reading of a cluster's launch environment
(`cluster_env`). The Dockerfile lives at the repository root."""
