"""The embedding modules that execute a plan: local tables (TorchRec), PS tables, and the hybrid of both."""
