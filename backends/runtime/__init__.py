"""The runtime: the program (a lowered step, its drafter, cost curve and hooks) and the one decode loop over rows."""
