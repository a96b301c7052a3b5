"""The performance model: hardware profiles, calibration, closed-form costs, event
simulation, prediction, recommendation and validation against measured benches."""
