"""Cluster glue: the supervisor that restarts a job, and the health check run before each restart."""
