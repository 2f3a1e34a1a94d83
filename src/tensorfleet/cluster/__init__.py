"""Who is in the job: ClusterSpec, TaskSpec, TF_CONFIG and flags, variable placement."""
