"""The daemon: wiring sources, the pure core and actuators into cycles."""
