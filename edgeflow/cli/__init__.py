"""edgeflow.cli"""
