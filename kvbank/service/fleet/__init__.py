"""A node in a fleet: :mod:`.fleet` (registration, heartbeat, peers, the change feed
published to Redis) and :mod:`.index` (the fleet index: which node holds which rows)."""
