"""tritonchat.kernels"""
