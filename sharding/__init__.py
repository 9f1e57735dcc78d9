"""Parallelism: meshes from a spec string, logical-axis rules, and the shardings of parameters and caches."""
