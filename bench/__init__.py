"""`tokembed bench`: the benchmark harness."""
