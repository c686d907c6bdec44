"""Sans-IO protocol cores: pure data and functions, no trio, no sockets."""
