"""anynorm benchmarks for asv: NumPy, torch CPU and CUDA, side by side with their peers."""
