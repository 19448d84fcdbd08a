"""Layer 4 (beside daemon): launching GPU work. Admission (occupancy, full-UUID locks,
re-observation under the locks), the plan, execution, the closeout and containers.
"""
