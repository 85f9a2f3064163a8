"""The benchmarks behind hotswap bench: from-process-start rows, reports and the fleet bench."""
