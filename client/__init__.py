"""tokembed.client"""
