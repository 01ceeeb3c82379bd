"""The Calibrator service: calibration sessions and the calibrations kept on disk."""
