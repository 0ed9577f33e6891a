"""What decoder layers are made of: attention over the paged pool and its backends, linears, ops, rotary."""
