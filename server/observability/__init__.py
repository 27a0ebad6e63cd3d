"""What the server tells its operators: Prometheus metrics (the calls, the batches, what is
served, the process) on their own HTTP port, and the logs."""
