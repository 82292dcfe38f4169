"""Seed-compatible modules (seed 001's dd_helpers, seed 002's ddp). Thin re-exports."""
