"""The node agent: starts, watches and stops the engine shards placed on its node."""
