"""A run: the stream and its stages, the services they stand on (rollout pools, the policy endpoint, the harness), the run folder, the cluster, the dry run and the GPU plan."""
