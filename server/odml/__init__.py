"""The OdmlExporter service: LiteRT (.tflite) export."""
