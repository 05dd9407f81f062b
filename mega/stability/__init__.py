"""Stability: detecting faults in a run and recovering from them (docs/stability-recovery.md)."""
