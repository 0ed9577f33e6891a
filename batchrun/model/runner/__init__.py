"""The model runner: one step of the contract on the model, block tables, CUDA graphs, memory planning."""
