"""Actuators: the only code that changes the world (engine processes, units, load balancers)."""
