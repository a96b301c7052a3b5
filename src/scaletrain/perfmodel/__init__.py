"""The performance model: hardware profiles, calibration, closed-form costs, event
simulation, prediction, recommendation and validation against measured benches."""

# What `predict --recommend` can rank configurations by (recommend.py; here so that the command line's
# parser names them without loading the model).
OBJECTIVES = ("throughput", "efficiency", "time-to-accuracy")
