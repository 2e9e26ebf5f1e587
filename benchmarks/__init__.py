"""Performance-regression benchmarks for kltriton: ``python -m benchmarks run|compare|plot``."""
