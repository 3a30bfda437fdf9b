"""Thin command-line front ends over the library: pack, inspect, demo."""
