"""Focused measurements, one question each: a kernel, the linears, the engine's overhead, a feature's cost."""
