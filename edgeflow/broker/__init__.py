"""Fleet broker tooling: Mosquitto configuration for a fleet, site bridges."""
