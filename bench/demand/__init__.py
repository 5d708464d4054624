"""Issue 21's acceptance: following demand, measured on a real stack (run.py)."""
