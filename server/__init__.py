"""tokembed.server"""
