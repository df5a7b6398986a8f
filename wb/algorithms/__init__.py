"""Algorithms over the data: probing a load function, planning, simulating a plan."""
