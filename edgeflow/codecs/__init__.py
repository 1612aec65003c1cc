"""edgeflow.codecs"""
