"""tritonchat.engine"""
