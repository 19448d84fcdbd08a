"""Helpers the tests and benchmarks share (no tests here): daemons, hosts, tools, stacks."""
