"""The HTTP routes, one module per resource; each `router(...)` takes the state it reads."""
