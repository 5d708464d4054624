"""The control-plane worker: runs deployment workflows and store activities."""
