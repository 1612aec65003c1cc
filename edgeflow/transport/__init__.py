"""edgeflow.transport"""
