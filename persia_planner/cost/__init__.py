"""The cost model: what a placement costs on a topology, its terms, constants and calibrated profile."""
