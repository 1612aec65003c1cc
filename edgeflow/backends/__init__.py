"""edgeflow.backends"""
