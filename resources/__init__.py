"""tritonchat.resources"""
