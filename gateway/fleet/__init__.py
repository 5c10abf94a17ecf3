"""The gateway's view of the fleet: placement, routing, the janitor, operator commands, pulls."""
