"""Prefect flows, their parameter model (the UI form), and the command-line interface."""
