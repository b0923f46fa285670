"""Sources: the I/O edge that reads engines and GPUs and hands frozen values to the pure core."""
