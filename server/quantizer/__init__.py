"""The Quantizer service: QuantizeParams streams and GetCapabilities."""
