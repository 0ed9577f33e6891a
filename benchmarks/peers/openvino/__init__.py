"""OpenVINO GenAI as a peer: its venv and IR exports, its worker, and its accuracy pass."""
